"""Reference solutions of the exercises, one module per notebook, one function per exercise."""
