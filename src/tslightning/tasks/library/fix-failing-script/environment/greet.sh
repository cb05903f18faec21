#!/bin/bash
# Greets the person named in the first argument.
if [ -z "$1" ] then
    echo "usage: greet.sh NAME" >&2
    exit 1
fi
echo "Hello, $1!"
