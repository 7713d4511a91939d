"""ShardReader: a deterministic, resumable stream of fixed-shape batches from the length-bucketed Arrow shards.

Batch i of the stream is a pure function of (seed, group, i): every batch holds `batch_size` rows of one bucket,
padded to the bucket edge (the shapes the warm-up compiled). Resuming at index i reproduces the same order exactly.
`group` consecutive batches (aligned: indices g*group .. g*group+group-1) come from one bucket, so the micro-batches
of one optimizer step (replicas x accumulation) cost the same and no replica waits for a longer one at the gradient
sum. An epoch is a whole number of groups (every epoch starts on a step): the batches that fill no group of their own
bucket close it in mixed groups, and fewer than `group` left over are skipped (others each epoch: rows reshuffle).
group 1 is the plain shuffle.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash.data.shards import verify_dataset
from dflash.errors import UserError

log = logging.getLogger("dflash.train")


@dataclass
class Batch:
    index: int                 # position in the stream
    input_ids: torch.Tensor    # [b, edge] long, padded with pad_id
    loss_mask: torch.Tensor    # [b, edge] bool
    lengths: torch.Tensor      # [b] long, unpadded lengths
    ids: list[str]             # sample ids, for tracing the data order

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    def pin(self) -> "Batch":
        return Batch(self.index, self.input_ids.pin_memory(), self.loss_mask.pin_memory(), self.lengths, self.ids)


def _check_row(tok, lm, edge: int) -> None:
    if len(tok) > edge or len(tok) != len(lm):
        raise ValueError(f"{len(tok)} tokens and {len(lm)} mask values in the bucket of length {edge}")


class ShardReader:
    def __init__(self, data_dir: str | Path, batch_size: int, seed: int = 0, pad_id: int = 0, group: int = 1):
        import datasets

        self.data_dir = Path(data_dir)
        self.manifest = verify_dataset(self.data_dir)    # once per run: the manifest, every file's sha256, the counts
        self.batch_size, self.seed, self.pad_id, self.group = batch_size, seed, pad_id, max(1, group)
        self.buckets: dict[int, "datasets.Dataset"] = {}
        for folder in sorted((self.data_dir / "train").glob("bucket-*")):
            edge = int(folder.name.split("-")[1])
            try:
                ds = datasets.load_from_disk(str(folder))
            except Exception as e:
                raise UserError(f"{folder}: cannot open the shards: {type(e).__name__}: {e}") from None
            if len(ds) >= batch_size:
                self.buckets[edge] = ds
        if not self.buckets:
            raise UserError(f"{self.data_dir}: no length bucket holds a full batch of {batch_size} rows")
        batches = sum(len(ds) // batch_size for ds in self.buckets.values())
        self.batches_per_epoch = batches // self.group * self.group
        if not self.batches_per_epoch:
            raise UserError(f"{self.data_dir}: {batches} batch(es) of {batch_size} rows, fewer than one optimizer "
                            f"step's {self.group} micro-batches (drafter replicas x train.grad_accum)")
        self._plans: dict[int, list[tuple[int, list[int]]]] = {}

    @property
    def edges(self) -> list[int]:
        return sorted(self.buckets)

    def _plan(self, epoch: int) -> list[tuple[int, list[int]]]:
        if epoch not in self._plans:
            groups, rest, g = [], [], self.group
            for edge, ds in sorted(self.buckets.items()):
                rows = list(range(len(ds)))
                random.Random(f"{self.seed}-{epoch}-{edge}").shuffle(rows)
                n = len(rows) // self.batch_size * self.batch_size
                batches = [(edge, rows[k:k + self.batch_size]) for k in range(0, n, self.batch_size)]
                full = len(batches) // g * g
                groups += [batches[k:k + g] for k in range(0, full, g)]
                rest += batches[full:]
            rng = random.Random(f"{self.seed}-{epoch}")
            rng.shuffle(groups)
            rng.shuffle(rest)
            plan = [b for grp in groups for b in grp] + rest
            self._plans = {epoch: plan[:self.batches_per_epoch]}  # keep one epoch in memory
        return self._plans[epoch]

    def batch(self, index: int) -> Batch:
        edge, rows = self._plan(index // self.batches_per_epoch)[index % self.batches_per_epoch]
        try:
            data = self.buckets[edge][rows]
            ids = torch.full((len(rows), edge), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), edge), dtype=torch.bool)
            lengths = torch.tensor([len(x) for x in data["input_ids"]], dtype=torch.long)
            for r, (tok, lm) in enumerate(zip(data["input_ids"], data["loss_mask"])):
                _check_row(tok, lm, edge)
                ids[r, :len(tok)] = torch.as_tensor(tok, dtype=torch.long)
                mask[r, :len(lm)] = torch.as_tensor(lm, dtype=torch.bool)
        except Exception as e:
            row, err = self._bad_row(edge, rows, e)
            raise UserError(f"{self._where(edge, row)}: cannot decode the row: {type(err).__name__}: {err} "
                            f"(rerun the data stage)") from None
        return Batch(index, ids, mask, lengths, list(data["id"]))

    def _bad_row(self, edge: int, rows: list[int], err: Exception) -> tuple[int, Exception]:
        """The first row of a failed batch that fails alone (the error path only), and its error."""
        for r in sorted(rows):
            try:
                x = self.buckets[edge][r]
                _check_row(x["input_ids"], x["loss_mask"], edge)
            except Exception as e:
                return r, e
        return min(rows), err

    def _where(self, edge: int, row: int) -> str:
        """'<shard file> row k': the file holding bucket row `row` (by per-file row counts), or the unreadable one."""
        import pyarrow as pa
        start = 0
        for f in self.buckets[edge].cache_files:
            try:
                with pa.memory_map(f["filename"]) as src:
                    n = pa.ipc.open_stream(src).read_all().num_rows
            except Exception:
                return f"{f['filename']} (unreadable)"
            if row < start + n:
                return f"{f['filename']} row {row - start}"
            start += n
        return f"{self.data_dir / 'train' / f'bucket-{edge:05d}'} row {row}"

    def shapes(self) -> list[tuple[int, int]]:
        """Every (batch, length) shape the stream can produce: what the warm-up must compile."""
        return [(self.batch_size, edge) for edge in self.edges]
