"""What the inline dashboard needs to behave in a JupyterLab cell as it does when served: an Enter
typed in one of its fields commits the field, and Panel's JavaScript runs in the page without being
kept in the saved notebook."""

from __future__ import annotations

import panel as pn
from panel.custom import JSComponent


class FieldsKeepEnter(JSComponent):
    """Inside a JupyterLab cell, an Enter typed in a field of the page around it commits the field.

    JupyterLab cancels the line break of an Enter typed anywhere inside a cell (its keydown handler
    prevents the `beforeinput` "insertLineBreak" whose target is in a `.jp-Cell`), and with it the
    `change` event by which a Bokeh input sends its value to Python: "5 + Enter" never arrives, Tab
    does. Bokeh's inputs sit in shadow DOM, so the event's target there is the page's outer element.
    As ipywidgets does for its fields, an Enter typed in an input or textarea of the page stops at
    that outer element, before JupyterLab's handler on the document sees it. Renders nothing.
    """

    _esm = """
    export function render({ view }) {
      const host = view.root.el
      if (host.dataset.fieldsKeepEnter) { return }
      host.dataset.fieldsKeepEnter = "1"
      host.addEventListener("keydown", (event) => {
        const field = event.composedPath()[0]
        if (event.key === "Enter" && field instanceof Element && field.matches("input, textarea")) {
          event.stopPropagation()
        }
      })
    }
    """


def load_extension_once_shown(inline: bool) -> None:
    """`pn.extension("plotly")`, whose outputs in a notebook carry Bokeh's and Panel's JavaScript
    (inline: 8 MB, twice, in every saved notebook). Each output is shown, which runs it in the page,
    then replaced by an empty one (update_display_data), so the saved notebook does not keep it."""
    from IPython import get_ipython
    from IPython.display import display
    from IPython.utils.capture import capture_output

    if get_ipython() is None:  # not in a notebook: nothing is published
        pn.extension("plotly", inline=inline)
        return
    with capture_output(stdout=False, stderr=False) as captured:
        pn.extension("plotly", inline=inline)
    for output in captured.outputs:
        handle = display(output.data, metadata=output.metadata, raw=True, display_id=True)
        handle.update({"text/plain": ""}, raw=True)
