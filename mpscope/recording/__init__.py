"""Recording below the Recorder: op-level recording (dispatch mode, autocast policy tables, audit)."""
