"""A whole Hugging Face checkpoint read as one tree, through the project's reader."""

from gpt_oss_train.io import hf


def read_hf_tree(path):
    """(architecture, nested dict of float32 numpy arrays) of a whole (small) Hugging Face
    checkpoint, through the project's reader."""
    ckpt = hf.HFCheckpoint(path)
    tree = {}
    for p in ckpt.param_paths():
        *head, last = p.split("/")
        node = tree
        for k in head:
            node = node.setdefault(k, {})
        node[last] = ckpt.read(p)
    return ckpt.model_config, tree
