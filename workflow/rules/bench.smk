# The H200 benchmark (not part of `all`): `snakemake --cores 1 bench_h200` on a machine with a GPU.
rule bench_h200:
    input:
        config="config/h200.yaml",
    output:
        "bench/out/bench.json",
    resources:
        gpu=1,
    log:
        LOGS / "bench_h200.log",
    benchmark:
        BENCH / "bench_h200.jsonl"
    conda:
        ENV
    shell:
        "python bench/h200.py --out bench/out > {log:q} 2>&1"
