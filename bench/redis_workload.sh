#!/bin/sh
# The client workload of the redis fault-injection evaluation: a fixed, deterministic
# mix of string, counter, list, hash and sorted-set commands sent through redis-cli,
# whose replies are the output compared with the golden run. Usage: redis_workload.sh PORT
port=$1
i=1
{
    while [ $i -le 60 ]; do
        echo "SET key:$i value-$i-abcdefghijklmnopqrstuvwxyz"
        echo "INCRBY counter $i"
        echo "RPUSH list item-$i"
        echo "HSET hash field-$((i % 17)) $i"
        echo "ZADD zset $((i * 7 % 101)) member-$i"
        echo "GET key:$((i / 2 + 1))"
        i=$((i + 1))
    done
    echo "GET counter"
    echo "LRANGE list 0 -1"
    echo "HGETALL hash"
    echo "ZRANGE zset 0 -1 WITHSCORES"
    echo "DBSIZE"
} | redis-cli -p "$port"
