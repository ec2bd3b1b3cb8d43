"""Which code called into sbp_torch: the first frame of a call's stack whose file lies outside given folders
(sbp_torch's, torch's). Frames are read by file path only, never by their locals: a warning names the user's line,
the check of plain inputs is keyed by the user's call site, and global mode leaves sbp_torch's own factory calls
plain."""

import os

import torch

OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # sbp_torch/
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def first_outside(frame, folders: tuple[str, ...]) -> tuple:
    """(The first of ``frame`` and its callers whose file lies outside ``folders``, or None; how many frames were
    passed over to reach it.)"""
    passed = 0
    while frame is not None and frame.f_code.co_filename.startswith(folders):
        frame, passed = frame.f_back, passed + 1
    return frame, passed
