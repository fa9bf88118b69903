"""Tools that build and judge the shipped `tiny-speaker` preset, outside the engine: its corpus
(`corpus`), its training (`python -m runner_tools.train_preset`) and the quality measures the weight
formats are judged by (`quality`). Nothing in runner_core or workbench imports them."""
