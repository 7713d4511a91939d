# Stage 'env': the environment fingerprint. It reruns when the pins or the installed packages change; the
# rules whose output it decides (warmup, train) take it as input.
rule env:
    input:
        pins="envs/requirements.txt",
    output:
        paths.fingerprint(RESULTS),
    params:
        stage_config=config_args,
        env=env_key(),
    log:
        LOGS / "env.log",
    benchmark:
        BENCH / "env.jsonl"
    conda:
        ENV
    shell:
        "python -m dflash env {params.stage_config:q} --out {output:q} --log {log:q}"
