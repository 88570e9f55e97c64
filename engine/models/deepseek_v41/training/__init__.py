"""`deepinfer train-tiny`: the tiny V4.1 model trained on the Python standard library (see run.py)."""
