"""The speedup oracle: measured costs of this device (`costs`), the cost model that turns them and a speculator's
acceptance into predicted tokens/s (`cost_model`), model shapes with random weights (`shapes`), `speculators
profile` (`profile`), its measured check (`check`) and report (`profile_report`). Not here: the engine itself."""
