"""Arrays in the forms the model and the kernels pass between them, below both.

lazy_weight    the interface of a weight that stands in for a dense array
layer_views    one layer of a layer-stacked weight, read in place (inference, CPU training)
mxfp4          the MXFP4 codec of the published checkpoints (numpy)
mxfp4_array    MXFP4 weights kept packed inside the model, decoded where a layer uses them
bit_moves      bfloat16 data moved as its uint16 bit patterns
"""
