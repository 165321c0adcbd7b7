"""Low-precision numerics: the OCP MX codecs (:mod:`k3train.quant.mx`) and quantization-aware training of the
routed experts (:mod:`k3train.quant.qat`)."""
