"""Data: the built-in corpus, the embedded tiny target, and dataset expansion into length-bucketed shards.

Public entry points used by other stages:
- `dflash.data.corpus.conversations(max_conversations)` -> list of {"id", "messages"} (OpenAI form)
- `dflash.data.tiny_target.build_target(target_cfg, out_dir, seed=0, corpus_size=1500)` -> build.json dict
- `dflash.data.expand.expand(loaded, out_dir, cache_dir=None)` -> manifest dict (writes shards, holdout.jsonl,
  manifest.json); the sharded form: `expand_part(loaded, shard, nshards, part_dir)` then
  `finish(loaded, [read_part(d) for d in part_dirs], out_dir)`
- `dflash.data.regen`: engines `hf`/`openai` and the resumable chunk cache
- `dflash.data.shards.verify_bucket(root, folder, manifest["files"])`: the reader's shard check
- `dflash.data.shards.load_manifest(dir)`, `bucket_dirs(dir)`, `read_holdout(dir)`
"""
