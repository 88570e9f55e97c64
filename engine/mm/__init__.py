"""Images in prompts: the inputs an engine takes (prepared images, embeddings at prompt positions),
placing image spans in a prompt, and the vision encoder a family supplies."""
