"""Models the package ships and names, and the MODULE:FACTORY specs that name any other.

`llama` is our small LLaMA (the `tiny` and `small` presets of training, the example of `inspect` and
`profile`); `factory` resolves `package.module:factory` specs for the CLI and the trainer alike. Both sit at
the bottom of the layers: they import nothing else of the package."""
