"""What a Session owns and runs on: the engine thread and its command queue (`engine_thread`), the loaded
models (`loaded_models`), the requests in flight (`routing`, `handles`), the bounded time series
(`metrics`), the demo workload (`workload`), the statistics tables (`stats`) and the folders a served
dashboard may load from (`model_roots`)."""
