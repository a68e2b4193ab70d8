"""Recording below the Recorder: op-level recording (dispatch mode, autocast policy tables, audit),
the PyTorch entry points a recorder wraps (patches), and the step buffer with its host copy."""
