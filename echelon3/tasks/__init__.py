"""The tasks the CLI runs: train, finetune, evaluate, run, predict, export; each assembles
its objects, then hands over."""
