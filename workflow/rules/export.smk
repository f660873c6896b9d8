"""`export: true` (ONNX) or a list of formats (onnx, safetensors) on an
experiment or sweep adds results/{exp}/model.onnx / model.safetensors as
targets, written from best.tar by `echelon3 export`; the leaderboard links
the ONNX file."""


rule export:
    """The network of best.tar as ONNX (or safetensors weights), on the CPU."""
    input:
        best="results/{exp}/best.tar",
        config=experiment_config,
        composed=composed_configs,
    output:
        model="results/{exp}/model.{fmt}",
    log:
        "logs/export/{exp}.{fmt}.log",
    wildcard_constraints:
        fmt="onnx|safetensors",
    group:
        experiment_group
    conda:
        "../envs/echelon3.yaml"
    resources:
        cpus_per_task=own_share(1),
        mem_mb=own_share(mem_mb),
        runtime=own_share(runtime),
    params:
        config_dir=config_dir,
        config_name=config_name,
        overrides=overrides,
        target=target_dir,
    shell:
        "echelon3 export -cd {params.config_dir:q} -cn {params.config_name:q} device=cpu"
        " {params.overrides:q} target.path={params.target:q}"
        " export.formats=[{wildcards.fmt}] > {log:q} 2>&1"
