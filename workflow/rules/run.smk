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
    conda:
        "../envs/echelon3.yaml"
    threads: cpus
    resources:
        cpus_per_task=cpus,
        mem_mb=mem_mb,
        runtime=runtime,
        nodes=1,
        gpu=one_gpu,
        tasks_per_gpu=no_tasks_per_gpu,
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
