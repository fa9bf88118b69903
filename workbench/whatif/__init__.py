"""What-if in the session: runner_core's simulated sweep over layouts run in a thread of its own
(`job.WhatifJob`, started by `Session.whatif`), and a model's memory on each layout."""
