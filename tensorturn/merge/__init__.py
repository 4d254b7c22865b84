"""An ensemble made one model: soups of fine-tunes from one start (distillation is a recipe that
a fused run trains, :mod:`tensorturn.recipes.distilled`)."""
