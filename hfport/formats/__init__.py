"""The on-disk formats hfport reads and writes besides the plain HF folder, one module each: detect, read (and the
names a writer uses). A low floor: these import only config/hub/errors/keymap/nn and the standard library, torch and
safetensors, so modeling, tasks, pipelines, train and export all read them from below.

    adapter               a LoRA adapter in PEFT's layout (adapter_config.json + adapter_model.safetensors)
    sentence_transformers a sentence-transformers folder (modules.json, Pooling, Normalize, prompts) and the
                          CrossEncoder marker
    onnx                  an ONNX folder (model.onnx, model_quantized.onnx, hfport_onnx.json)
    openvino              an OpenVINO folder (openvino_model.xml/.bin, the int8 IR beside it, hfport_openvino.json)
    graph_folder          what both graph folders share: the manifest, the default graph, file= (a GraphFolder
                          record each)
    tables                training data: CSV/TSV, JSONL, Parquet, Arrow IPC, datasets' save_to_disk folders, read
                          as streams of rows (pyarrow, the `data` extra, for the last three)
    jsonstream            a large JSON document walked a member or an element at a time, json's own errors at
                          the file's line and column (SQuAD files)
The run folder (RunDir) is hfport/rundir.py, on the same floor.
"""
