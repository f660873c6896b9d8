rule evaluate:
    """Score the best checkpoint of one experiment on its test data."""
    input:
        config=experiment_config,
        composed=composed_configs,
        best="results/{exp}/best.tar",
    output:
        metrics="results/{exp}/metrics.json",
    log:
        "logs/evaluate/{exp}.log",
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
        "{params.launch} echelon3 evaluate"
        " -cd {params.config_dir:q} -cn {params.config_name:q}"
        " {params.devices:q} {params.overrides:q} target.path={params.target:q}"
        " evaluator.config.output={output.metrics:q} > {log:q} 2>&1"
