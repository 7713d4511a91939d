"""The statistics the data chain's steps record, per source: counts and reject reasons (a part's part.json `stats` and
`rejects`; summed by the gather into manifest.json's `sources`).

Public:
- `Tally(keys=COUNTS)`: `counts[source]` ({key: n} from `keys`, plus the code source's from_*_files),
  `rejects[source]` (Counter of reasons); `reject(source, reason)`, `files(source, evaluable)`,
  `close_source(name, path)` (after reading one source: its checks), `take(read)` (a read tally's counts)
- `COUNTS`, `READ`: the keys of a part's tally and of a read tally
"""
from __future__ import annotations

from collections import Counter, defaultdict

from dflash.errors import UserError

COUNTS = ("rows", "kept", "samples", "holdout", "truncated")   # a part's, per source (manifest.json sources.<name>)
READ = ("rows", "valid")                                       # the read steps' (read, normalise, dedupe)


class Tally:
    """Per-source counts and reject reasons. The read steps run in every data shard but record into their own
    Tally(READ), which only shard 0 adds to its part's (`take`), so the parts add up."""

    def __init__(self, keys=COUNTS):
        self.counts: dict[str, dict] = defaultdict(lambda: dict.fromkeys(keys, 0))
        self.rejects: dict[str, Counter] = defaultdict(Counter)
        self._files: dict[str, Counter] = defaultdict(Counter)

    def reject(self, source: str, reason: str):
        self.rejects[source][reason] += 1

    def files(self, source: str, evaluable: bool):
        """A valid conversation made from a file (the code source): from a held-out file or a pre-training one."""
        self._files[source][evaluable] += 1

    def close_source(self, name: str, path: str):
        """After reading source `name`: its file counts recorded; a source with no rows, or none valid, refused."""
        st = self.counts[name]
        if self._files[name]:
            st.update(from_pretrain_files=self._files[name][False], from_heldout_files=self._files[name][True])
        if not st["rows"]:
            raise UserError(f"source '{name}': {path} has no rows")
        if not st["valid"]:
            raise UserError(f"source '{name}' ({path}): all {st['rows']} rows rejected "
                            f"({', '.join(f'{k}: {v}' for k, v in self.rejects[name].most_common())})")

    def take(self, read: Tally):
        """Add a read tally's counts (but `valid`) and rejects, source by source."""
        for name, st in read.counts.items():
            self.counts[name].update((k, v) for k, v in st.items() if k != "valid")
            self.rejects[name].update(read.rejects[name])

    def record(self) -> tuple[dict, dict]:
        """(stats, rejects) as part.json holds them."""
        return {k: dict(v) for k, v in self.counts.items()}, {k: dict(v) for k, v in self.rejects.items()}
