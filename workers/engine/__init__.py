"""The denoise engine: the runs one denoise worker holds, advanced a step at a time together,
their rows sharing transformer forwards while each stays bit-identical to a run alone."""
