# Stage 'env': the environment fingerprint. It reruns when the pins or the installed packages change (its stamp holds
# the pins' content and the packages' versions); the rules whose output it decides (warmup, train) take it as input.
PINS = "envs/requirements.txt"


rule env:
    input:
        pins=ancient(PINS),
        stamp=stamp("env", files=[("pins", PINS)], extra={"packages": json.loads(env_key())}),
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
