"""Command-line entry points (tyro): ``python -m mff.recipes.pretrain`` and, later, finetune,
eval, generate, convert and preprocess."""
