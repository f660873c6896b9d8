"""Experiments that start from another experiment's best weights.

`init_from: <experiment>` on an experiment (or on a sweep: every point) makes
its train job a `finetune` job: the train rule with the parent's best.tar as an
input and `init_from.checkpoint` pointing at it. A retrained parent is a newer
input, so the child reruns; echelon3 sees new source weights in the run's
fingerprint and starts the child over (on_config_change=restart)."""


ruleorder: finetune > train


use rule train as finetune with:
    input:
        config=experiment_config,
        composed=composed_configs,
        parent=parent_best,
    output:
        best=f"results/{{exp,{CHILDREN}}}/best.tar",
        summary=f"results/{{exp,{CHILDREN}}}/summary.json",
    params:
        config_dir=config_dir,
        config_name=config_name,
        overrides=finetune_overrides,
        launch=launch,
        devices=devices,
        target=target_dir,
