"""Training an EAGLE-style head offline (``python -m engine train-head``): prompts, self-distilled
answers, teacher-forced features and the training loop.
"""
