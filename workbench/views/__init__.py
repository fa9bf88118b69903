"""The dashboards: every control and form defined once (`fields`, `forms`), the tabs laid out once (`layout`) and
refreshed once (`dashboard`), the actions on them (`controller`, `whatif_view`), made in the browser by Panel
(`panel_app`) and in the notebook by ipywidgets (`widgets`); the charts they and the lessons draw (`charts`,
`timeline`, `perf_charts`, `tuning_charts`, `whatif_charts`); `notebook_output` and `panel_writer` keep Panel usable
in JupyterLab and over its websocket."""
