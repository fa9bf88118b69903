"""Panel's websocket writer made to write every queued patch (a served dashboard's pages); Panel 1.5-1.9."""

from __future__ import annotations


def write_queued_patches() -> None:
    """Close a race in Panel's websocket writer (panel.io.document, Panel 1.9) that left a page's last update
    unsent. While a page's websocket is busy, Panel queues the page's patches in `_WRITE_MSGS` and starts a
    `_dispatch_msgs` task to write them; a task that has written its batch clears `_WRITE_BLOCK`, and a task
    that starts after that returns at once. So a patch queued while the previous batch was still being
    written, whose task started just after that batch's task ended, stayed queued until the page's next
    change; after a generation's last refresh there is none, and the page kept "3 tokens · 80.5 tokens/s"
    for good. Here a task that finds patches queued writes them."""
    from panel.io import document

    dispatch = document._dispatch_msgs
    if getattr(dispatch, "writes_queued_patches", False):
        return

    async def dispatch_queued(doc) -> None:
        if doc in document._WRITE_MSGS:
            document._WRITE_BLOCK[doc] = True
        await dispatch(doc)

    dispatch_queued.writes_queued_patches = True
    document._dispatch_msgs = dispatch_queued
