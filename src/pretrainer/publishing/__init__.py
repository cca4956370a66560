"""Publishing a finished run, above the loop: the Hub upload with a model card written from the run directory
(`hub`). Called by the scripts (`run_recipe.py` after training, `export_checkpoint.py --push-to-hub`)."""
