# Light aggregation: on a cluster it runs where Snakemake runs, not as a job.
localrules:
    report,


rule report:
    """Leaderboard (CSV + Markdown, best first) and plots over all experiments.
    The learning curves read each run's history.jsonl, which train writes
    beside best.tar."""
    input:
        metrics=results("results/{exp}/metrics.json"),
        best=results("results/{exp}/best.tar"),
        models=export_targets(),
    output:
        csv=report(
            "results/leaderboard.csv",
            category="Leaderboard",
            labels={"table": "leaderboard"},
        ),
        md="results/leaderboard.md",
        curves=curve_plots(),
        bars=report(
            "results/plots/metrics.png",
            category="Metrics",
            labels={"plot": "metrics by experiment"},
        ),
    log:
        "logs/report.log",
    conda:
        "../envs/echelon3.yaml"
    params:
        experiments=report_labels(),
        histories=results("results/{exp}/history.jsonl"),
        metric=config["leaderboard"]["metric"],
        higher_is_better=config["leaderboard"]["higher_is_better"],
    script:
        "../scripts/report.py"
