"""Resampling: upsampling (nearest, bilinear, and the 1-d/3-d forms that decompose), adaptive average and max
pooling (uniform and PyTorch's non-uniform windows), grid_sample, and fold (col2im)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.ops.harness import Case, In, check

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
Dim = torch.export.Dim


def interp(**kw):
    return lambda x: F.interpolate(x, **kw)


UPSAMPLE = {
    "nearest_x2": dict(scale_factor=2), "nearest_size": dict(size=(7, 5)), "nearest_down": dict(size=(3, 2)),
    "nearest_frac_scale": dict(scale_factor=1.7), "nearest_scale_hw": dict(scale_factor=(2.0, 0.5)),
    "bilinear_x2": dict(scale_factor=2, mode="bilinear"), "bilinear_size": dict(size=(9, 7), mode="bilinear"),
    "bilinear_align": dict(scale_factor=1.5, mode="bilinear", align_corners=True),
    "bilinear_align_size": dict(size=(8, 3), mode="bilinear", align_corners=True),
    "bilinear_down": dict(size=(2, 3), mode="bilinear"),
    "bilinear_recompute": dict(scale_factor=1.3, mode="bilinear", recompute_scale_factor=True),
    "bilinear_to_one": dict(size=(1, 1), mode="bilinear", align_corners=True),
}
TOL_LINEAR = {torch.float16: 2e-3, torch.bfloat16: 2e-2}
"""Interpolation runs in float32 and rounds once; eager rounds the half-precision weights too, one ulp apart."""

CASES: list[Case] = []
for name, kw in UPSAMPLE.items():
    linear = kw.get("mode") == "bilinear"
    for dt in FLOATS:
        CASES.append(Case(f"upsample_{name}_{str(dt)[6:]}", interp(**kw), (In((2, 3, 4, 5), dt),),
                          tol=TOL_LINEAR.get(dt) if linear else None))
    CASES.append(Case(f"upsample_{name}_noncontig", interp(**kw), (In((3, 2, 5, 4), noncontiguous=True),)))
CASES += [
    Case("upsample_nearest_uint8", interp(size=(5, 4)), (In((1, 1, 3, 3), torch.uint8, "index:200"),)),
    Case("upsample_nearest_special", interp(scale_factor=2), (In((1, 1, 2, 3), fill="special"),)),
    Case("upsample_bilinear_special", interp(scale_factor=2, mode="bilinear"), (In((1, 1, 3, 3), fill="special"),)),
    Case("upsample_nearest_empty_batch", interp(scale_factor=2), (In((0, 2, 3, 3)),)),
    Case("upsample_nearest1d", interp(scale_factor=2), (In((2, 3, 5)),)),
    Case("upsample_nearest1d_size", interp(size=7), (In((2, 3, 5)),)),
    Case("upsample_linear1d", interp(scale_factor=2, mode="linear"), (In((2, 3, 5)),)),
    Case("upsample_linear1d_align", interp(size=9, mode="linear", align_corners=True), (In((2, 3, 5)),)),
    Case("upsample_nearest3d", interp(scale_factor=2), (In((1, 2, 2, 3, 3)),)),
    Case("upsample_nearest3d_size", interp(size=(3, 4, 5)), (In((1, 2, 2, 3, 3)),)),
    Case("upsample_trilinear", interp(scale_factor=2, mode="trilinear"), (In((1, 2, 2, 3, 3)),)),
    Case("upsample_trilinear_align", interp(size=(3, 5, 4), mode="trilinear", align_corners=True),
         (In((1, 2, 2, 3, 3)),)),
    Case("upsample_nearest_exact", interp(scale_factor=2, mode="nearest-exact"), (In((1, 2, 3, 3)),)),
    Case("upsample_bicubic", interp(scale_factor=2, mode="bicubic"), (In((1, 2, 3, 3)),)),
    Case("upsample_module", torch.nn.Upsample(scale_factor=2, mode="bilinear"), (In((1, 2, 4, 4)),)),
    Case("upsample_nearest_dynamic", interp(scale_factor=2), (In((1, 2, 4, 5)),),
         dynamic=({2: Dim("h", max=64), 3: Dim("w", max=64)},), run_shapes=(((1, 2, 4, 5),), ((1, 2, 7, 3),))),
    Case("upsample_bilinear_dynamic_batch", interp(size=(6, 6), mode="bilinear"), (In((2, 2, 4, 5)),),
         dynamic=({0: Dim("b", max=8)},), run_shapes=(((2, 2, 4, 5),), ((3, 2, 4, 5),))),
]

ADAPTIVE = {
    "avg2d_nonuniform": lambda x: F.adaptive_avg_pool2d(x, (3, 4)),
    "avg2d_up": lambda x: F.adaptive_avg_pool2d(x, (7, 9)),
    "avg2d_uniform": lambda x: F.adaptive_avg_pool2d(x, (2, 3)),
    "avg2d_none": lambda x: F.adaptive_avg_pool2d(x, (None, 4)),
    "avg1d_nonuniform": lambda x: F.adaptive_avg_pool1d(x[0], 4),
    "avg3d": lambda x: F.adaptive_avg_pool3d(x[None], 2),
    "avg3d_nonuniform": lambda x: F.adaptive_avg_pool3d(x[None], (2, 3, 4)),
    "max2d": lambda x: F.adaptive_max_pool2d(x, (3, 4)),
    "max2d_uniform": lambda x: F.adaptive_max_pool2d(x, 2),
    "max2d_one": lambda x: F.adaptive_max_pool2d(x, 1),
    "max1d": lambda x: F.adaptive_max_pool1d(x[0], 4),
    "max3d": lambda x: F.adaptive_max_pool3d(x[None], (2, 3, 4)),
}
for name, fn in ADAPTIVE.items():
    for dt in FLOATS:
        CASES.append(Case(f"adaptive_{name}_{str(dt)[6:]}", fn, (In((2, 3, 6, 7), dt),),
                          tol=TOL_LINEAR.get(dt) if "avg" in name else None))
    CASES.append(Case(f"adaptive_{name}_noncontig", fn, (In((2, 3, 6, 7), noncontiguous=True),)))
CASES += [
    Case("adaptive_max2d_special", lambda x: F.adaptive_max_pool2d(x, (2, 2)), (In((1, 1, 3, 5), fill="special"),)),
    Case("adaptive_avg2d_special", lambda x: F.adaptive_avg_pool2d(x, (2, 2)), (In((1, 1, 3, 5), fill="special"),)),
    Case("adaptive_avg_module", torch.nn.AdaptiveAvgPool2d((5, 3)), (In((1, 4, 7, 7)),)),
    Case("adaptive_max_module", torch.nn.AdaptiveMaxPool2d((5, 3)), (In((1, 4, 7, 7)),)),
]


def grid_sample(**kw):
    return lambda x, g: F.grid_sample(x, g, **kw)


for mode in ("bilinear", "nearest"):
    for padding in ("zeros", "border", "reflection"):
        for align in (False, True):
            kw = dict(mode=mode, padding_mode=padding, align_corners=align)
            name = f"grid_sample_{mode}_{padding}_{'align' if align else 'noalign'}"
            # grid values spread over about [-2, 2]: inside and outside the image, to exercise the padding rule
            CASES.append(Case(name, grid_sample(**kw), (In((2, 3, 5, 6)), In((2, 4, 7, 2)))))
for dt in (torch.float16, torch.bfloat16):
    CASES.append(Case(f"grid_sample_{str(dt)[6:]}", grid_sample(align_corners=False),
                      (In((1, 2, 4, 4), dt), In((1, 3, 3, 2), dt)), tol=TOL_LINEAR[dt] * 2))
CASES += [
    Case("grid_sample_noncontig", grid_sample(align_corners=False), (In((2, 3, 5, 6), noncontiguous=True),
                                                                    In((2, 4, 7, 2)))),
    Case("grid_sample_affine", lambda x, t: F.grid_sample(x, F.affine_grid(t, [2, 3, 5, 6], align_corners=False),
                                                          align_corners=False), (In((2, 3, 5, 6)), In((2, 2, 3)))),
    Case("grid_sample_one_pixel", grid_sample(align_corners=True), (In((1, 2, 1, 1)), In((1, 3, 3, 2)))),
    Case("fold", lambda x: F.fold(x, (4, 5), (2, 2)), (In((2, 12, 12)),)),
    Case("fold_stride_pad", lambda x: F.fold(x, (5, 5), 3, stride=2, padding=1), (In((1, 18, 9)),)),
    Case("fold_dilation", lambda x: F.fold(x, (5, 6), 2, dilation=2), (In((1, 8, 12)),)),
    Case("fold_noncontig", lambda x: F.fold(x, (4, 5), (2, 2)), (In((2, 12, 12), noncontiguous=True),)),
    Case("unfold_fold", lambda x: F.fold(F.unfold(x, 3, padding=1), (5, 5), 3, padding=1), (In((1, 2, 5, 5)),)),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_resize(case: Case, backend: str) -> None:
    check(case, backend)
