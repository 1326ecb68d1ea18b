"""The model's input and output sizes, torch-free: what the slab and the front-ends size their buffers by.

They are the numbers of torchvision's ImageNet preset for ResNet18 (resize 256, centre crop 224, 1000 classes);
resnet_server.common.preprocess checks at import that the preset still says so, so the two cannot drift apart."""

from __future__ import annotations

CROP = 224  # the preset's centre crop: the model's input is CROP x CROP
RESIZE = 256  # the preset's shorter side before the crop
NUM_CLASSES = 1000
FLOAT_SHAPE = (3, CROP, CROP)  # the model's float32 input, normalised: CHW
CROP_SHAPE = (CROP, CROP, 3)  # a front-end's uint8 crop, as it travels: HWC
