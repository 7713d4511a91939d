# Stage 'target': build the tiny, code or random-weight target into target.path. With build none there is no rule:
# target.path must already hold a model folder (an input of every rule that loads it, by content: their stamps hold
# its files' sizes and sha256). Otherwise an existing target.path must be a folder the target stage built (its
# build.json): a model the user points at is never replaced. The job holds a GPU when the code build pre-trains on one
# (as the data rule's DATA_GPU).
TARGET_GPU = int(CFG.target.build == "code" and CFG.target.pretrain.device != "cpu")

if CFG.target.build != "none":
    # Snakemake removes a rule's output before its job: a folder this pipeline did not build is refused now
    try:
        check_target_out(TARGET_DIR, RESULTS)
    except (ConfigError, UserError) as e:
        raise WorkflowError(str(e)) from None
    TARGET_STAMP = stamp("target", TARGET_DIR)
    # a built target changed in place since (build.json records its files) is refused by every stage that loads it:
    # the plan says so now, in the stages' words, unless the target rule reruns anyway (a changed key, -R target; a
    # cluster job reading the workflow again was planned so)
    if ("target", TARGET_DIR) not in STAMPS.moved and not forced("target", [TARGET_DIR]) and not workflow.remote_exec:
        try:
            _changed = target_problem(TARGET_DIR)
        except UserError as e:  # a file of it that cannot be read
            raise WorkflowError(str(e)) from None
        if _changed:
            raise WorkflowError(_changed)

    rule target:
        input:
            stamp=TARGET_STAMP,
        output:
            directory(TARGET_DIR),
        params:
            stage_config=config_args,
            config=rerun_by("target"),
        threads: 1
        resources:
            gpu=TARGET_GPU,
        log:
            LOGS / "target.log",
        benchmark:
            BENCH / "target.jsonl"
        conda:
            ENV
        shell:
            "python -m dflash target {params.stage_config:q} --out {output:q} --threads {threads} --log {log:q}"
