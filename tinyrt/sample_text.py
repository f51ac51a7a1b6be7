"""English text that every Python ships: the Python documentation topics (`pydoc_data.topics`),
prose with code. The default AWQ calibration text and `tinyrt bench`'s prompt; never the text a
model is evaluated on."""

from __future__ import annotations


def default_text() -> str:
    """The Python documentation topics of this Python (about 465k characters for 3.11)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))
