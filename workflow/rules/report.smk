# Light aggregation: on a cluster it runs where Snakemake runs, not as a job.
localrules:
    report,


rule report:
    """Leaderboard (CSV, Markdown, HTML; best first) and plots over all
    experiments. The learning curves read each run's history.jsonl, which train
    writes beside best.tar, and mark the epoch of best.tar from summary.json; a
    fine-tuned run's curves continue its parent's. The leaderboard's val column is
    best.tar's validation score (summary.json), its test columns metrics.json."""
    input:
        metrics=results("results/{exp}/metrics.json"),
        summaries=results("results/{exp}/summary.json"),
        models=export_targets(),
    output:
        csv=report(
            "results/leaderboard.csv",
            caption="../report/leaderboard.rst",
            category="Leaderboard",
            labels={"table": "leaderboard (CSV)"},
        ),
        md="results/leaderboard.md",
        html=report(
            "results/leaderboard.html",
            caption="../report/leaderboard.rst",
            category="Leaderboard",
            labels={"table": "leaderboard"},
        ),
        curves=curve_plots(),
        bars=report(
            "results/plots/metrics.png",
            caption="../report/metrics.rst",
            category="Metrics",
            labels={"plot": "test metrics by experiment"},
        ),
        sweeps=sweep_plots(),
    log:
        "logs/report.log",
    conda:
        "../envs/echelon3.yaml"
    params:
        experiments=report_labels(),
        sweeps=sweep_points(),
        histories=results("results/{exp}/history.jsonl"),
        parents=PARENTS,  # chains.smk
        metric=config["leaderboard"]["metric"],
        higher_is_better=config["leaderboard"]["higher_is_better"],
    script:
        "../scripts/report.py"
