"""Each parallelism as functions over modules; a model family's plan composes them."""
