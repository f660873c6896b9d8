"""The character GPT's own target: `snakemake -j1 char_gpt` plans the token files, the
training and the generated text, outside the default target."""

from __future__ import annotations

from tests.workflow.helpers import copy_workflow, planned, shell_commands, snakemake


def test_char_gpt_target_plans_its_three_jobs_with_the_token_files(tmp_path):
    out = snakemake(copy_workflow(tmp_path), "-n", "-p", "char_gpt")
    assert planned(out) == {("char_text", None), ("char_gpt_train", None),
                            ("char_gpt_generate", None), ("char_gpt", None)}
    commands = {c.split(" -cd ")[0]: c for c in shell_commands(out) if c != "None"}
    assert commands.keys() == {"python -m echelon3.datasets.char_text results/char_text > "
                               "logs/char_text.log 2>&1", "echelon3 train", "echelon3 run"}
    train, generate = commands["echelon3 train"], commands["echelon3 run"]
    assert train.startswith("echelon3 train -cd config/experiments -cn char_gpt ")
    assert ("data.train.config.path=results/char_text/train.bin "
            "data.val.config.path=results/char_text/val.bin "
            "target.path=results/char_gpt ") in train
    assert generate.startswith("echelon3 run -cd config/experiments -cn char_gpt ")
    assert ("runner.config.vocab=results/char_text/vocab.json target.path=results/char_gpt "
            "runner.config.output=results/char_gpt/generated.txt ") in generate
