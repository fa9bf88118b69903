"""ModelLoader: a checkpoint in, a model out, and back.

* `model_loader`: resolve `model` (a directory, a catalogue name, a hub id in the local cache), read its
  config, build the model with every layer's storage planned, stream the weights in, the tokenizer and
  processor;
* `weight_utils`: reading safetensors only, one mapping window at a time, TP sharding on read;
* `checkpoint_writer`: a model saved as stored (int8/int4 included) and read back;
* `tokenizer`: the tokenizer and the incremental detokenizer.
"""
