"""Data: the built-in corpus, the embedded tiny and code targets, and dataset expansion into length-bucketed shards.

Public entry points used by other stages:
- `dflash.data.corpus.conversations(max_conversations)` -> list of {"id", "messages"} (OpenAI form)
- `dflash.data.tiny_target.build_target(target_cfg, out_dir, seed=0, corpus_size=1500)` -> build.json dict
- `dflash.data.code_target.build_code_target(target_cfg, out_dir, seed=0)` -> build.json dict (`build: code`)
- `dflash.data.code_corpus`: the code corpus, `is_heldout` (its file split) and "complete this function"
  conversations; `completion_source(target_cfg.pretrain, data_cfg.code_completion)` is the `code` data source
- `dflash.data.pretrain.pretrain(model, tokens, ...)`, `mean_nll(...)`: the targets' pre-training loop and NLL
- the data stage, a chain of steps composed in `dflash.data.expand` (README.md beside this file draws it):
  `expand.build(loaded, out_dir, shard=None, parts=None)` -> its record (part or manifest, unwritten);
  `expand.expand(loaded, out_dir, cache_dir=None)` -> manifest dict (writes shards, holdout.jsonl, manifest.json);
  the sharded form: `expand.expand_part(loaded, shard, nshards, part_dir)` then
  `gather.finish(loaded, [gather.read_part(d) for d in part_dirs], out_dir)`
- its steps: `sources` (read, normalise), `select` (dedupe, hold out, scatter), `regen` (regenerate), `samples`
  (tokenise, filter, weight over Arrow), `gather` (gather, shard); `tally` (what each records), `spill`,
  `synthetic` (data.synthetic's rows)
- `dflash.data.tokenise`: chat templates, token ids and the loss mask; `dflash.data.rows`: the per-row rules
- `dflash.data.regen`: engines `hf`/`openai` and the resumable chunk cache; `dflash.data.generate.regenerate`: the
  in-process generation driver and its batch size
- `dflash.data.shards.verify_dataset(dir)`: the folder exactly as the data stage wrote it (the reader's check);
  `read_manifest(dir)` (the manifest matching its own hash), `verify_file(dir, name)` (e.g. holdout.jsonl),
  `sealed(dir, manifest)` (adds the file hashes and the manifest's own hash; `gather.write_manifest` writes it as
  the `records.manifest.Manifest`, `shards.write_manifest` any other dict), `bucket_dirs(dir)`,
  `read_holdout(dir)`
"""
