rule train:
    """Train one experiment. Its rolling checkpoints live beside best.tar in
    results/{exp}/ but are no declared output, so Snakemake leaves them alone
    when a job fails and echelon3 resumes from them on the rerun. summary.json
    is written last: a stopped job never leaves a complete-looking output."""
    input:
        config=experiment_config,
        composed=composed_configs,
    output:
        best="results/{exp}/best.tar",
        summary="results/{exp}/summary.json",
    log:
        "logs/train/{exp}.log",
    group:
        experiment_group
    conda:
        "../envs/echelon3.yaml"
    threads: cpus
    resources:
        cpus_per_task=train_cpus_per_task,
        mem_mb=mem_mb,
        runtime=runtime,
        nodes=nodes,
        gpu=train_gpus,
        gres=train_gres,
        tasks=train_tasks,
        tasks_per_gpu=train_tasks_per_gpu,
        mpi=train_mpi,
    params:
        config_dir=config_dir,
        config_name=config_name,
        overrides=overrides,
        launch=launch,
        devices=devices,
        target=target_dir,
    shell:
        "{params.launch} echelon3 train"
        " -cd {params.config_dir:q} -cn {params.config_name:q} on_config_change=restart"
        " {params.devices:q} {params.overrides:q} target.path={params.target:q}"
        " > {log:q} 2>&1"
