"""Reading labelled data, splitting it, tokenizing it, batching it, and the prompt a text is read in."""
