"""A config's sweep: named runs, each a set of key overrides over the config, expanded into the workflow's runs.

`sweep.runs` lists them in the config (`[{run: NAME, KEY: VALUE, ...}, ...]`, dotted keys) or names a runs sheet: a
TSV or CSV file whose header is `run` and one dotted key per column, one run a row, a cell read as YAML (`1e-4` a
number, `[1, 2]` a list), an empty cell leaving the key to the config, `#` lines skipped (the snakemake-workflows
template's sample sheet, one run a row). Every run is the config with its overrides, validated as the config is: a bad
row is one line naming the sheet, the row (its line) and the key.

What a run may change: any key but the ones its runs share. One target per sweep (keys whose role rebuilds the target
are refused, `seed` excepted: a row's seed is its training seed, the target and the datasets keep the config's), one
placement (device keys), the names (the row's `run` names its run; `dataset_name` names its data), the files the
workflow reads (`Reads` keys) and the sweep itself. A run whose data keys differ from the config's gets its own dataset
(`dataset_name` if the row gives one, else `<dataset_name>-<8 hex of its data keys>`), shared by every run with the
same data keys; a run whose compiled-graph keys differ (`train.num_anchors`, ...) compiles them in its train job (the
warm-up job warms the config's graphs).

The config's own run (`run_name`, no overrides) is always a run: the pipeline's product (exported, reported). Which
runs the evaluate stage decodes: `sweep.evaluate: all` every run, at evaluate.temperature (acceptance.json) and each of
`sweep.temperatures` (acceptance-t<T>.json); `own` only the config's own run, the others' tau at temperature 0 being
their last in-training evaluation (train.eval_every), which is the evaluate stage's measure when it is made at the
last step on the stage's prompts and tokens (dflash/evaluate/replay.py: equal step for step): a candidate then costs
its training and a few seconds, not a minute and a half of batch-1 decoding more.

Public: `expand(loaded) -> Sweep` (ConfigError naming file, row and key); `Sweep.runs` ({name: Run}, the config's own
first), `Sweep.datasets` ({name: Loaded of its data}), `Sweep.record()` (what the sweep table's stamp holds);
`Run.sets` (`--set` values for the stages), `Run.decoded` and `Run.temperatures`. `sweep.only` keeps the runs its
names or shell patterns match (a part of a sweep per session), every row still validated.
"""
from __future__ import annotations

import copy
import csv
import dataclasses
import difflib
import fnmatch
import hashlib
import json
import re
from pathlib import Path

from dflash.config import ConfigError, Loaded, device_keys, from_dict, path_keys, roles, set_dotted, trigger
from dflash.config_model import NAME, NAME_MAX

# the keys no row may set, and why (besides those derived from the roles below)
FIXED = {"run_name": "the row's `run` names its run", "results_dir": "the runs share the results folder"}


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    overrides: dict            # {dotted key: value} over the config (empty for the config's own run)
    loaded: Loaded             # the config with them (and run_name, dataset_name)
    dataset: str               # the dataset it trains on (a name in Sweep.datasets)
    own: bool                  # the config's own run
    decoded: bool              # the evaluate stage decodes it (acceptance.json)
    temperatures: tuple[float, ...] = ()   # the other temperatures it is decoded at (acceptance-t<T>.json)

    @property
    def sets(self) -> list[str]:
        """The `--set KEY=VALUE` values that make a stage read this run's config (none for the config's own run)."""
        if self.own:
            return []
        keys = {**self.overrides, "run_name": self.name, "dataset_name": self.dataset}
        return [f"{k}={json.dumps(v)}" for k, v in keys.items()]


@dataclasses.dataclass(frozen=True)
class Sweep:
    runs: dict[str, Run]
    datasets: dict[str, Loaded]
    sets: dict[str, list[str]]          # {dataset: its --set values for the data stage}
    source: str                         # where the rows came from (the sheet, or the config)
    baseline: str

    @property
    def declared(self) -> bool:
        return len(self.runs) > 1

    def record(self) -> dict:
        """What decides the sweep table besides the runs' outputs: the runs, their overrides, the baseline."""
        return {"runs": {n: r.overrides for n, r in self.runs.items()}, "baseline": self.baseline,
                "temperatures": {n: list(r.temperatures) for n, r in self.runs.items()}}


def _refused(key: str) -> str | None:
    """Why a row may not set `key` (None: it may)."""
    if key in FIXED:
        return FIXED[key]
    if key.startswith("sweep."):
        return "the sweep is the config's"
    if key in device_keys():
        return "the runs share the config's placement (one GPU job at a time)"
    if key in path_keys():
        return "it names a file or folder: set it in the config"
    if key != "seed" and "target" in roles()[key].reruns:
        return "the runs share the config's target: set it in the config"
    return None


def _closest(key: str) -> str:
    near = difflib.get_close_matches(key, list(roles()), n=1, cutoff=0.7)
    return f" (did you mean {near[0]}?)" if near else ""


def _cell(text: str, where: str):
    from dflash.config import parse_value
    return parse_value(text, where)


def read_sheet(path: str) -> list[tuple[str, dict]]:
    """(where, row) of each run of a TSV/CSV runs sheet: `where` names the file and line, a row maps `run` and the
    dotted keys of its non-empty cells to their values (read as YAML)."""
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the runs sheet ({e.strerror or e})") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip() and not line.startswith("#")]
    if not lines:
        raise ConfigError(f"{path}: the runs sheet is empty: give a header (run, then one key per column) and a row "
                          f"per run")
    delimiter = "\t" if p.suffix.lower() in (".tsv", ".tab") or "\t" in lines[0][1] else ","
    rows = list(csv.reader([line for _, line in lines], delimiter=delimiter))
    header = [h.strip() for h in rows[0]]
    if not header or header[0] != "run":
        raise ConfigError(f"{path}:{lines[0][0]}: the first column of the runs sheet must be `run`, got "
                          f"{header[0] if header else 'nothing'!r}")
    twice = sorted({h for h in header if header.count(h) > 1})
    if twice:
        raise ConfigError(f"{path}:{lines[0][0]}: column {twice[0]} given twice")
    out = []
    for (n, _), cells in zip(lines[1:], rows[1:]):
        where = f"{path}:{n}"
        if len(cells) != len(header):
            raise ConfigError(f"{where}: {len(cells)} cells for the {len(header)} columns of the header")
        row = {"run": cells[0].strip()}
        for key, text in zip(header[1:], cells[1:]):
            if text.strip():
                row[key] = _cell(text.strip(), f"{where} {key}")
        out.append((where, row))
    return out


def _rows(loaded: Loaded) -> tuple[str, list[tuple[str, dict]]]:
    runs = loaded.cfg.sweep.runs
    if runs is None:
        return loaded.source, []
    if isinstance(runs, str):
        return runs, read_sheet(runs)
    return loaded.source, [(f"{loaded.source}: sweep.runs[{i}]", dict(r)) for i, r in enumerate(runs)]


def _data_keys(raw: dict, seed) -> str:
    """The data trigger of a run's config with the config's seed: what decides its dataset (a row's seed trains, it
    does not remake the data)."""
    raw = copy.deepcopy(raw)
    raw["seed"] = seed
    return trigger(raw, "data")


def _check_row(where: str, row: dict, raw: dict) -> tuple[str, dict]:
    name = row.get("run")
    if not isinstance(name, str) or not re.match(NAME, name) or len(name) > NAME_MAX:
        raise ConfigError(f"{where}: run {name!r} must be a folder name (letters, digits, _ . -, not starting with . "
                          f"or -, at most {NAME_MAX} characters)")
    overrides = {k: v for k, v in row.items() if k != "run"}
    for key in overrides:
        if key not in roles():
            raise ConfigError(f"{where} ({name}): unknown key '{key}'{_closest(key)}")
        parts = key.split(".")
        if any(isinstance(_at(raw, parts[:i]), list) for i in range(1, len(parts))):
            raise ConfigError(f"{where} ({name}): key '{key}' is inside a list: set the list in the config")
        if key != "dataset_name" and (why := _refused(key)):
            raise ConfigError(f"{where} ({name}): key '{key}' cannot vary in a sweep: {why}")
    return name, overrides


def _at(raw: dict, parts: list[str]):
    for p in parts:
        raw = raw.get(p) if isinstance(raw, dict) else None
    return raw


def expand(loaded: Loaded) -> Sweep:
    """The runs of `loaded`'s sweep (the config's own alone when it declares none), each validated as a config."""
    cfg, sw = loaded.cfg, loaded.cfg.sweep
    source, rows = _rows(loaded)
    base_data = _data_keys(loaded.raw, loaded.raw["seed"])
    own = Run(cfg.run_name, {}, loaded, cfg.dataset_name, True, True, _temps(sw.temperatures, cfg.evaluate.temperature))
    runs, datasets = {own.name: own}, {cfg.dataset_name: loaded}
    data_of, sets = {cfg.dataset_name: base_data}, {cfg.dataset_name: []}
    named = set()
    for where, row in rows:
        name, overrides = _check_row(where, row, loaded.raw)
        if name in runs or name in named:
            what = "the config's own run (run_name)" if name == own.name else "another row"
            raise ConfigError(f"{where}: run {name} is also {what}: give each run its own name")
        named.add(name)
        if sw.only is not None and not any(fnmatch.fnmatchcase(name, p) for p in sw.only):
            continue
        given = overrides.pop("dataset_name", None)
        raw = set_dotted(copy.deepcopy(loaded.raw), {**overrides, "run_name": name})
        run_loaded = from_dict(raw, f"{where} ({name})")
        data = _data_keys(run_loaded.raw, loaded.raw["seed"])
        dataset = given or (cfg.dataset_name if data == base_data else
                            f"{cfg.dataset_name}-{hashlib.sha256(data.encode()).hexdigest()[:8]}")
        if data_of.setdefault(dataset, data) != data:
            raise ConfigError(f"{where} ({name}): dataset_name {dataset} is the dataset of other data keys "
                              f"({'the config' if dataset == cfg.dataset_name else 'another row'}): give this run's "
                              f"data its own dataset_name, or leave it out")
        run_loaded = from_dict(set_dotted(run_loaded.raw, {"dataset_name": dataset}), f"{where} ({name})")
        if dataset not in datasets:
            keep = {k: v for k, v in overrides.items() if k != "seed" and "data" in roles()[k].reruns}
            sets[dataset] = [f"{k}={json.dumps(v)}" for k, v in {**keep, "dataset_name": dataset}.items()]
            datasets[dataset] = from_dict(set_dotted(copy.deepcopy(loaded.raw), {**keep, "dataset_name": dataset}),
                                          f"{where} ({name})")
        decoded = sw.evaluate == "all"
        if not decoded:
            _check_replayed(where, name, overrides, run_loaded)
        temps = _temps(sw.temperatures, run_loaded.cfg.evaluate.temperature) if decoded else ()
        runs[name] = Run(name, overrides, run_loaded, dataset, False, decoded, temps)
    unmatched = [p for p in sw.only or () if not any(fnmatch.fnmatchcase(n, p) for n in named)]
    if unmatched:
        raise ConfigError(f"{loaded.source}: sweep.only: {unmatched[0]} matches no run of the sweep (runs: "
                          f"{', '.join(sorted(named)) or 'none'})")
    baseline = sw.baseline or own.name
    if baseline not in runs:
        raise ConfigError(f"{loaded.source}: sweep.baseline names run {baseline}, which is not a run of the sweep "
                          f"(runs: {', '.join(runs)})")
    return Sweep(runs, datasets, sets, source, baseline)


def _temps(temperatures, own: float) -> tuple[float, ...]:
    return tuple(dict.fromkeys(t for t in temperatures if t != own))


def _check_replayed(where: str, name: str, overrides: dict, run: Loaded) -> None:
    """Under sweep.evaluate own, a run's tau at temperature 0 is its last in-training evaluation: it must be made, on
    the evaluate stage's prompts and tokens, and the row may not ask for another evaluation."""
    decoded = [k for k in overrides if k.startswith("evaluate.")]
    if decoded:
        raise ConfigError(f"{where} ({name}): key '{decoded[0]}' asks for an evaluation, but sweep.evaluate is own "
                          f"(only the config's own run is decoded): set sweep.evaluate: all, or drop the key")
    t = run.cfg.train
    if not t.eval_every or t.eval_prompts is not None or t.eval_max_new_tokens is not None \
            or run.cfg.evaluate.temperature != 0:
        raise ConfigError(f"{where} ({name}): sweep.evaluate is own, so this run's tau is its last in-training "
                          f"evaluation, which is the evaluate stage's measure only with train.eval_every > 0, "
                          f"train.eval_prompts and train.eval_max_new_tokens null and evaluate.temperature 0 "
                          f"(here {t.eval_every}, {t.eval_prompts}, {t.eval_max_new_tokens}, "
                          f"{run.cfg.evaluate.temperature}): set them so, or sweep.evaluate: all")
