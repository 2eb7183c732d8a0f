#!/bin/sh
# torchvision from the index is a CUDA build whose C++ ops do not load beside the CPU torch; two
# of its meta registrations are not guarded on that, so importing it fails ("operator
# torchvision::nms does not exist"). Guard them in the environment $1 the way torchvision
# guards the others; the image models the tests run use none of its C++ ops.
set -eu
venv=$1
meta=$("$venv/bin/python" -c 'import importlib.util as u; print(u.find_spec("torchvision").submodule_search_locations[0])')/_meta_registrations.py
sed -i \
    -e 's|^@torch.library.register_fake("torchvision::nms")$|@(torch.library.register_fake("torchvision::nms") if torchvision.extension._has_ops() else (lambda f: f))|' \
    -e 's|^@torch.library.register_fake("torchvision::qnms")$|@(torch.library.register_fake("torchvision::qnms") if torchvision.extension._has_ops() else (lambda f: f))|' \
    "$meta"
"$venv/bin/python" -c 'import torchvision' || {
    echo "guard-torchvision: torchvision still does not import in $venv" >&2
    exit 1
}
