from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/checks.smk"
include: "workflow/rules/signals.smk"


# One line naming the key at fault, before anything is planned.
check_schema(config, "workflow/schemas/config.schema.yaml")
check_config_files(config)
check_sweep_keys(config)
warn_placeholder_slurm_settings()


include: "workflow/rules/common.smk"
include: "workflow/rules/warm.smk"
include: "workflow/rules/chains.smk"
include: "workflow/rules/groups.smk"
include: "workflow/rules/report_inputs.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/finetune.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/run.smk"
include: "workflow/rules/export.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/summary.smk"
include: "workflow/rules/char_gpt.smk"


rule all:
    default_target: True
    input:
        all_targets(),
