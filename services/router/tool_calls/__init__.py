"""Tool calling: the request's tools and ``tool_choice`` (``tool_use``), the chat template's
view of them (``rendering``), and the model's calls parsed out of its text (``parsers``)."""
