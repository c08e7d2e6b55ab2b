"""``zj.plan``: will a model fit? The real step compiled for a mesh of the
target size, in a child process, and audited."""
