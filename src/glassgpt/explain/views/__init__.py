"""The views of explain's results: text, pictures and notebook HTML. They read results; no analysis imports them."""
