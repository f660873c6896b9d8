rule run:
    """Predict with the best checkpoint of one experiment."""
    input:
        config=experiment_config,
        composed=composed_configs,
        best="results/{exp}/best.tar",
    output:
        predictions="results/{exp}/predictions.csv",
    log:
        "logs/run/{exp}.log",
    group:
        experiment_group
    conda:
        "../envs/echelon3.yaml"
    threads: cpus
    resources:
        cpus_per_task=own_share(cpus),
        mem_mb=own_share(mem_mb),
        runtime=own_share(runtime),
        nodes=own_share(1),
        gpu=own_share(one_gpu),
        tasks_per_gpu=own_share(no_tasks_per_gpu),
    params:
        config_dir=config_dir,
        config_name=config_name,
        overrides=overrides,
        launch=launch,
        devices=devices,
        target=target_dir,
    shell:
        "{params.launch} echelon3 run"
        " -cd {params.config_dir:q} -cn {params.config_name:q}"
        " {params.devices:q} {params.overrides:q} target.path={params.target:q}"
        " runner.config.output={output.predictions:q} > {log:q} 2>&1"
