"""Recording below the Recorder: op-level recording (dispatch mode, autocast policy tables, audit),
the PyTorch entry points a recorder wraps (patches), the step buffer with its host copy, the fp32
shadow (float32 reference forward, SQNR per module and op output) and output naming."""
