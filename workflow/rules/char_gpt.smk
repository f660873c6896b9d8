"""A character-level GPT on the stdlib's pydoc topics, outside the default target:
`snakemake -j1 char_gpt` prepares the token files, trains config/experiments/char_gpt.yaml
and writes the text it generates (docs/transformers.md)."""

CHAR_TEXT = "results/char_text"


rule char_text:
    """Character token files of the pydoc topics (echelon3.datasets.char_text)."""
    output:
        train=f"{CHAR_TEXT}/train.bin",
        val=f"{CHAR_TEXT}/val.bin",
        vocab=f"{CHAR_TEXT}/vocab.json",
    log:
        "logs/char_text.log",
    conda:
        "../envs/echelon3.yaml"
    resources:
        mem_mb=2000,
        runtime=10,
    params:
        folder=target_dir,
    shell:
        "python -m echelon3.datasets.char_text {params.folder:q} > {log:q} 2>&1"


rule char_gpt_train:
    """Train the character GPT on the token files."""
    input:
        config=CONFIG_DIR / "char_gpt.yaml",
        train=rules.char_text.output.train,
        val=rules.char_text.output.val,
    output:
        best="results/char_gpt/best.tar",
        summary="results/char_gpt/summary.json",
    log:
        "logs/train/char_gpt.log",
    conda:
        "../envs/echelon3.yaml"
    threads: 2
    resources:
        mem_mb=4000,
        runtime=30,
    params:
        config_dir=CONFIG_DIR,
        target=target_dir,
    shell:
        "echelon3 train -cd {params.config_dir:q} -cn char_gpt on_config_change=restart"
        " data.train.config.path={input.train:q} data.val.config.path={input.val:q}"
        " target.path={params.target:q} > {log:q} 2>&1"


rule char_gpt_generate:
    """Text the trained character GPT generates (its config's `runner`)."""
    input:
        config=CONFIG_DIR / "char_gpt.yaml",
        best=rules.char_gpt_train.output.best,
        vocab=rules.char_text.output.vocab,
    output:
        text="results/char_gpt/generated.txt",
    log:
        "logs/run/char_gpt.log",
    conda:
        "../envs/echelon3.yaml"
    threads: 2
    resources:
        mem_mb=2000,
        runtime=10,
    params:
        config_dir=CONFIG_DIR,
        target=target_dir,
    shell:
        "echelon3 run -cd {params.config_dir:q} -cn char_gpt"
        " runner.config.vocab={input.vocab:q} target.path={params.target:q}"
        " runner.config.output={output.text:q} > {log:q} 2>&1"


rule char_gpt:
    """The character GPT's generated text, and all it takes."""
    input:
        rules.char_gpt_generate.output.text,
