from snakemake.utils import min_version, validate

min_version("9.0")


configfile: "config/config.yaml"


validate(config, "workflow/schemas/config.schema.yaml")


include: "workflow/rules/common.smk"
include: "workflow/rules/chains.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/finetune.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/run.smk"
include: "workflow/rules/export.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        all_targets(),
